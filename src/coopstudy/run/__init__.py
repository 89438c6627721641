"""Running an arm: launching its processes, the training worker (the one loop),
the device lock, the CPU capacity check of probes, and the verified checkpoint."""
