"""The gunicorn target `gunicorn 'webhook.wsgi:create()'`; $GPUSHARD_CONFIG and $GPUSHARD_CLUSTER configure it."""
from webhook.admission import serving

create = serving.app_from_env  # a factory, so nothing is built at import and each worker builds its own
