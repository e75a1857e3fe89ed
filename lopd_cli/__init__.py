"""The ``lopd`` command line: one module per area, assembled into one Typer app by :mod:`lopd_cli.main`.

It sits above both the library (``lopd_core``) and the Prefect flows (``flows``): the pipeline commands run
flows, so the library never has to import the orchestrator. Modules that reach Prefect (``pipeline``,
``compare``) import the flows inside the command functions, so ``lopd --help`` and the commands that need
no orchestration start without importing Prefect.
"""
