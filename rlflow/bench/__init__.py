"""`rlflow bench` and its relatives: every method and peer on every model, measured the same way (`run`), the rows
and the files written from them (`results`), the machine's peak and versions (`machine`), on a Ray cluster
(`cluster`), as a user's wall clock (`wallclock`), the peer tools (`peers`) and the rule library's own speed
(`rule_speed`).
"""
