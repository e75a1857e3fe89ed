"""Thin Prefect flows over lopd_core."""
