//! Metrics and access logs.
//!
//! - [`metrics`]: Prometheus metrics with Istio's names and labels (so
//!   existing dashboards work) plus ztunnel's own.
//! - [`connection`]: one record per proxied connection: counts it as opened,
//!   then on close adds bytes, counts it as closed and writes the access log
//!   line (tracing target `access`).

pub mod connection;
pub mod metrics;

pub use connection::{ConnectionRecord, Endpoint};
pub use metrics::Metrics;
