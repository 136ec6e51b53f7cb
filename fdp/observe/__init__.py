"""Observability: debug levels, logging data, runtime stats, DETAIL checks, reports."""
