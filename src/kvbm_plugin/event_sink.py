"""GPU-tier KV event sink (filled by the event-sink issue)."""
