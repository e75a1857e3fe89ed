"""pandera data contracts for every frame that crosses a pipeline stage."""
