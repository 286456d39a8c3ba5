"""Continuum's shared runtime: settings, database, migrations, gRPC bootstrap, errors, auth, logs.

Nothing domain-specific lives here; services share only this and the generated protobuf package.
"""
