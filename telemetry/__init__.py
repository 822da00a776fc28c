"""What the server tells its operator: in-process statistics and the Prometheus exporter."""

from telemetry.stats import ServerStats, Timing

__all__ = ["ServerStats", "Timing"]
