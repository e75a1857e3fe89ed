"""Rollout engines behind one interface (:class:`lopd_core.rollout.engines.base.Engine`)."""
