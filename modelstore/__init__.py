"""The model store, shared by the roles: versions of the weights (:mod:`modelstore.store`), their
bit-exact codec (:mod:`modelstore.codec`) and the fleet's desired-state record beside them
(:mod:`modelstore.desired`). Serving loads versions and watches the record, the learner
publishes versions and reads the pause, deploy changes the record; none of them imports
another role's package for it."""
