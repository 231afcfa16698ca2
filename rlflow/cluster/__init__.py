"""Work spread over a Ray cluster without a shared disk: the connection and its measurement slot (`connection`), the
files a task needs carried through Ray's object store and cost tables carried both ways (`travel`).  The bench
(`rlflow.bench.cluster`) and the trainers (`rlflow.train.cluster`) build on it.

Nothing here is imported without `--ray`: one machine needs no cluster.
"""
