"""Model loading (HF causal LMs, the embedded default, the tiny test model), composer, latent injection."""
