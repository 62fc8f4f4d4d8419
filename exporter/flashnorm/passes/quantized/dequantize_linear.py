def plan(node, activation, gain, where):
    return None
