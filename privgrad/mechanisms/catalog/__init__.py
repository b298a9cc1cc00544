"""The built-in mechanisms, one declaration per file (:class:`~privgrad.mechanisms.registry.
MechanismSpec`); importing one imports no torch, its ``build`` imports the stages."""
