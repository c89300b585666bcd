"""Elastic training: supervisors that re-plan for the surviving GPUs and resume from the newest checkpoint.

- `faults`: injected failures (a killed worker, a frozen one, a lost host) and recoveries, and when
  they fire;
- `store`: stores bound to one address, and rendezvous messages signed with the job's token;
- `rendezvous`: the supervisors' rendezvous, where each round is agreed: heartbeats and leases, the
  round's deadline, the leader's office (fixed on the embedded store, elected on etcd);
- `etcd`: the rendezvous's store on an etcd cluster (`--rdzv-backend etcd`);
- `progress`: hang detection: the workers' progress records and the supervisors' verdict;
- `supervisor`: one node's supervisor: report health, agree on a plan, run torchrun, watch it;
- `launch`: `elastor run --cluster 4,4` on one machine, one supervisor process per simulated node;
- `lifeline`: every process of a run (supervisor, torchrun, worker) dies with its parent;
- `report`: the recovery breakdown read back from the metrics file.
"""
