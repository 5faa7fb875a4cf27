"""What both backends of the agent stand on: the node's cards, their health and limits, and the node's other parts."""
