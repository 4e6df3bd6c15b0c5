"""Several engine replicas behind one endpoint on Ray Serve: routing, affinity, migration (`statelm serve --replicas`).

`launch`, `replica`, `placement` and `router` import Ray; the rest is plain Python that tests use without it.
"""
