"""The sample shards, shared by the roles: how a shard is named and written
(:mod:`samplestore.shards`, the ingest workers), found and read (:mod:`samplestore.catalog`,
the learner), and queried (:mod:`samplestore.source`, :mod:`samplestore.votes`: the canary,
the CUPED covariate, the report). No role imports another role's package for them."""
