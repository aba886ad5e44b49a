"""Several engine replicas behind one router: the routing policy (`routing`, pure and tested without Ray),
a trace-driven cluster simulator (`cost_model`, `simulator`) and the Ray Serve application (optional
extra `loraplex[cluster]`). docs/cluster.md describes the design."""
