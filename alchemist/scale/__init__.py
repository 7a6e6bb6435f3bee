"""Scale-out: replicas that each serve and train, on Ray, behind one HTTP front (``alchemist serve --replicas N``).

    replica.py   a complete server in a Ray actor, restarted by Ray when it dies
    front.py     the HTTP front: routes requests (conversation affinity) and feedback (to the record's replica)
    serve.py     starts (or joins) Ray, the replicas and the front
"""
