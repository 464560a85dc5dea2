"""The scheduler process: queue, admission, policy, radix cache, pool metadata, page tables, plans,
outputs, the step loop, DP attention's lockstep scheduler."""
