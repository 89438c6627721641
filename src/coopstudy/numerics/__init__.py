"""The numbers of an update: batching, the objective, the optimizer step, the
distributed all-reduce and PowerSGD hook, and the gate that checks them against
the per-document reference. Everything here is a numerical source: the gate
receipt and the plan bind these files' bytes."""
