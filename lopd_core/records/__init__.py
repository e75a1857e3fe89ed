"""The records every layer shares, and chat rendering: the bottom of the package graph.

- :mod:`.trajectory`: :class:`~lopd_core.records.trajectory.Trajectory`, one episode as the trainer sees it;
- :mod:`.experience`: :class:`~lopd_core.records.experience.Experience`, the retrieval query, the
  :class:`~lopd_core.records.experience.Retriever` protocol, the leakage rules and the
  :class:`~lopd_core.records.experience.Bank` a training run retrieves from;
- :mod:`.chat`: rendering chat messages to token ids with the model's template (student and teacher
  sequences stay aligned token for token).

Nothing here imports the rest of ``lopd_core`` (a test walks the graph), and nothing needs torch.
"""

from lopd_core.records.experience import CONTENT_DIM, Bank, Experience, RetrievalQuery, Retriever, allowed
from lopd_core.records.trajectory import Trajectory

__all__ = ["CONTENT_DIM", "Bank", "Experience", "RetrievalQuery", "Retriever", "Trajectory", "allowed"]
