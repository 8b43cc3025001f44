"""The fleet: Hearth's engines as Ray Serve replicas behind our own request router.

`fleet.app` deploys one Serve application per model, `fleet.replica` is what each replica runs, `fleet.router`
places requests (session affinity, cached prefixes, resident adapters, load) and `fleet.client` is how the
control plane reaches them. Depends on `inference`, never on Django.
"""
