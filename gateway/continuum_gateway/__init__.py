"""Continuum's HTTP gateway: browser-facing JSON over HTTP, translated to the services' gRPC APIs.

The gateway holds no state of its own. It authenticates the browser's bearer token, calls the
services with the service credential and the acting user, and renders their answers (and their
errors, as AIP-193 bodies) as JSON.
"""

SERVICE_NAME = "gateway"
