"""The admin API (`/admin/...`, the admin scope): one folder per domain: keys, audit, policies
and deployments, rewards, training, users (purge), metrics and the dashboard."""
