"""Hook-using methods: one file each, registered in :data:`rlpost.methods.base.METHODS`.

:meth:`rlpost.methods.base.MethodSet.for_config` picks the ones a run config
uses; the registry loads every method file on first lookup
(:mod:`rlpost.methods.catalog`). See :mod:`rlpost.methods.base` for the hooks.
"""
