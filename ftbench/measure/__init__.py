"""`ftbench calibrate` (`python -m ftbench.measure`): measure the machine at hand with the
project's own engine, transport and checkpoint store, and write a hardware profile.

Modules, one measurement each: `ops` (F, B, W, BW and the optimizer step through the
executor), `memory` (large copies: memory and host-snapshot bandwidth), `storage`
(CheckpointStore save and load), `peer` (the second process: a fresh interpreter timed from
its start to its first iteration, then the far end of the link measurements), `links`
(point-to-point, all-reduce, process-group creation over gloo), `detection` (death to
regroup with the dist backend's heartbeats), `fit` (the least-squares lines), `profile`
(the YAML and the summary), `cli` (arguments and the order of the steps).

Importing this package does not import torch (`ftbench --help` stays cheap).
"""
