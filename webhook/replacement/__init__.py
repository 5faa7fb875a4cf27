"""Re-placement: one leader evicts pinned pods that wait on a full card while another card has room.

``controller`` is the loop behind `gpushard replace` (its own Deployment, not `gpushard serve`),
``cache`` what the leader plans over (shared nodes and pinned pods, followed by watch), and
``lease`` the Lease election that lets one replica act. What to evict is decided in
``webhook.core.replacement``; this package lists, evicts and records.
"""
