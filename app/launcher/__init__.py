"""Start a whole Gyre deployment on one machine and stop it without leaving a process behind.

`Deployment` (a context manager) starts NATS and Postgres (embedded, or uses the external URLs
given by GYRE_NATS_URL / GYRE_DATABASE_URL / the config), applies every service's migrations,
then starts each service as its own OS process group, in dependency order, and waits until each
is serving. `gyre up` is a thin command around it; `gyre run` builds on it.
"""

from app.launcher.endpoints import Endpoints, ServiceEndpoint

__all__ = ["Deployment", "DeploymentError", "Endpoints", "ServiceEndpoint"]


def __getattr__(name: str) -> object:
    # Deployment pulls in the embedded servers and the store; import it only when asked for.
    if name in {"Deployment", "DeploymentError"}:
        from app.launcher import deployment

        return getattr(deployment, name)
    raise AttributeError(name)
