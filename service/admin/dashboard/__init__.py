"""The operators' dashboard: GET /admin/ (a static page) and its files under /admin/static/."""
