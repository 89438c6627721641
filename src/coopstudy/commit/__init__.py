"""Commitments and their checks: the hash-chained ledger, the sources a
commitment binds, receipts, the plan, the budget, the final candidates, and
`require` (what a step needs, re-hashed before it runs)."""
