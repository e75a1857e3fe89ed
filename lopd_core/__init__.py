"""lopd_core — the library behind the LOPD continual-learning pipeline.

Imports only torch, transformers, peft and the standard scientific stack at module level; Prefect, MLflow
and LanceDB are imported inside the modules that need them (``memory``, ``registry``), so the core runs on a
GPU box that has only the training stack.
"""

__version__ = "0.1.0"
