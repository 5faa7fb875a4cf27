"""The API plumbing every part of gpushard may import: the client and its failures (``connecting``), the one
list-and-watch loop (``informing``) and leader election on a Lease (``lease``). It knows nothing of cards."""
