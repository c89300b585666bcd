"""Elastic training: supervisors that re-plan for the surviving GPUs and resume from the newest checkpoint.

- `faults`: injected failures and recoveries (`n1:3@20`) and when they fire;
- `rendezvous`: the supervisors' own rendezvous (a TCPStore) where each round is agreed;
- `supervisor`: one node's supervisor: report health, agree on a plan, run torchrun, watch it;
- `launch`: `elastor run --cluster 4,4` on one machine, one supervisor process per simulated node;
- `lifeline`: every process of a run (supervisor, torchrun, worker) dies with its parent;
- `report`: the recovery breakdown read back from the metrics file.
"""
