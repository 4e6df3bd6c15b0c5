"""Several engine replicas behind one endpoint on Ray Serve: routing, affinity, migration (`statelm serve --replicas`).

Only `statelm.cluster.launch`, `replica` and `router` import Ray; the rest is plain Python that tests use without it.
"""
