"""Live-traffic metrics per policy version over time: GET /admin/metrics."""
