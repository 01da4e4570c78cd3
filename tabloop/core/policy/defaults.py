"""How the policy samples when nothing says otherwise: the serving defaults, here so that the
service's settings (tabloop/core/config.py) read them without importing torch."""

DEFAULT_TEMPERATURE = 0.7  # serving default; the gate is fitted for it
DEFAULT_TOP_P = 0.95  # serving default nucleus
DEFAULT_MAX_CONTEXT_TOKENS = 96  # prefix tokens seen when serving: same exact match as 160 here
# the confidence stop: a completion ends before the first token (after the healed text) the model
# gives a log-prob below this, so what is shown is the part it is sure of (docs/MODEL.md)
DEFAULT_STOP_LOGPROB = -1.0
# stop_reason of a request in a language the policy was not trained on: no model call, nothing
# sampled, an abstention the policy did not choose (the trainer never trains on it)
STOP_LANGUAGE = "language"
