"""The node agent: one per node, between that node's workers and the controller.

It never imports the store (or anything of ``fleet.controlplane``): it speaks to the
controller only over gRPC (``fleet.proto``).
"""
