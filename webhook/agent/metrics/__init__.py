"""The agent's /metrics: the cards, the processes on them, and which pods they belong to."""
