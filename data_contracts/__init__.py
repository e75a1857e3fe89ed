"""pandera data contracts for every frame that crosses a pipeline stage.

- :mod:`data_contracts.models`: the strict DataFrameModels (trajectories, curated and indexed experiences,
  evaluation results, quarantine rows) and :data:`SCHEMA_VERSION`, written into every row;
- :mod:`data_contracts.validate`: :func:`validate_frame` (valid rows / quarantine rows with the failed
  checks; nothing dropped silently) and :class:`StageQualityError` (the bad-share limit);
- :mod:`data_contracts.convert`: Trajectory lists ↔ frames, experience rows → retrieval records.

This package imports pandas and pandera; it is not part of ``lopd_core`` (which must import without them).
"""

from data_contracts.convert import (
    evaluation_frame,
    frame_to_experiences,
    frame_to_trajectories,
    records_to_trajectory_frame,
    row_to_experience,
    row_to_trajectory,
    trajectories_to_frame,
    trajectory_to_row,
)
from data_contracts.models import (
    CONTENT_DIM,
    CONTRACTS,
    SCHEMA_VERSION,
    EvaluationSchema,
    ExperienceSchema,
    IndexedExperienceSchema,
    QuarantineSchema,
    TrajectorySchema,
    contract_columns,
    contract_key,
)
from data_contracts.validate import StageQualityError, enforce_bad_share, quarantine_rows, validate_frame

__all__ = [
    "CONTENT_DIM",
    "CONTRACTS",
    "SCHEMA_VERSION",
    "EvaluationSchema",
    "ExperienceSchema",
    "IndexedExperienceSchema",
    "QuarantineSchema",
    "StageQualityError",
    "TrajectorySchema",
    "contract_columns",
    "contract_key",
    "enforce_bad_share",
    "evaluation_frame",
    "frame_to_experiences",
    "frame_to_trajectories",
    "quarantine_rows",
    "records_to_trajectory_frame",
    "row_to_experience",
    "row_to_trajectory",
    "trajectories_to_frame",
    "trajectory_to_row",
    "validate_frame",
]
