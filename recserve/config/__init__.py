"""One validated cluster spec (TOML) → typed config objects."""

from recserve.config.load import DEFAULT_SPEC, default_config, load, loads
from recserve.config.spec import (
    CascadeConfig,
    ClusterConfig,
    FeatureConfig,
    GatewayConfig,
    GenerationServiceConfig,
    LookupConfig,
    RankerConfig,
    RoutingConfig,
    ShardingConfig,
    ShardServerConfig,
    TableConfig,
    TenantConfig,
)

__all__ = [
    "DEFAULT_SPEC", "default_config", "load", "loads", "CascadeConfig", "ClusterConfig", "FeatureConfig",
    "GatewayConfig", "GenerationServiceConfig", "LookupConfig", "RankerConfig", "RoutingConfig", "ShardingConfig", "ShardServerConfig", "TableConfig", "TenantConfig",
]
