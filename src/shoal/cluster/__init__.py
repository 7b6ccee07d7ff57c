"""Cluster mode on Ray: one node agent per Ray node, one SDK over the whole cluster (`shoal.Client("ray://ADDR")`),
`shoal cluster up|status|down` and `shoal serve --cluster ray://ADDR`. See docs/cluster.md."""
