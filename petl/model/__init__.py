"""What makes and changes a model: the backbone interface, the method registry and wrappers, surgery, merging,
unloading, the per-row hooks, timm's methods on a petl model, and the trainable-weights file.

Nothing here imports from the layers above it (train, store, deploy, bench, cli); the public names live in
:mod:`petl`.
"""
