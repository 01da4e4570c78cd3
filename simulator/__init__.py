"""Simulated editors replaying held-out code against a running tabloop (`tabloop simulate`).

`population` holds the people (pure decision logic), `client` the HTTP side (`tabloop.client`:
batching, retries; plus the admin calls), `run` the loop, `display` the live learning curve,
`report` the buckets, summary and plot, `baseline` the pretrained policy's best fixed threshold,
computed offline.
"""
