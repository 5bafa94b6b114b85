"""The HTTP routes of `flexmarl serve`, one router per concern: the OpenAI-compatible endpoints,
the run's graph and feedback, and the operator's admin endpoints."""
