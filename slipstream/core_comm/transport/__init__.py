"""How a rank exchanges with its peers on the other nodes: the group's own gloo, or K TCP
connections per peer (``tcp``, whose sockets and threads are ``_lanes``)."""
