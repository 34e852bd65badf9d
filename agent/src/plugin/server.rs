//! The `DevicePlugin` gRPC service for one resource.

use std::pin::Pin;
use std::sync::Arc;

use gpu_agent_proto::deviceplugin::v1beta1::device_plugin_server::DevicePlugin;
use gpu_agent_proto::deviceplugin::v1beta1::{
    AllocateRequest, AllocateResponse, ContainerPreferredAllocationResponse, Device,
    DevicePluginOptions, Empty, HEALTHY, ListAndWatchResponse, NumaNode, PreStartContainerRequest,
    PreStartContainerResponse, PreferredAllocationRequest, PreferredAllocationResponse,
    TopologyInfo, UNHEALTHY,
};
use hostlib::HostRoot;
use tokio::sync::watch;
use tokio_stream::Stream;
use tonic::{Request, Response, Status};

use super::allocate;
use super::preferred;
use super::resources::{PluginSettings, Resource};
use crate::inventory::Inventory;

/// The options every gpu-agent plugin announces.
pub fn options() -> DevicePluginOptions {
    DevicePluginOptions {
        pre_start_required: false,
        get_preferred_allocation_available: true,
    }
}

/// The kubelet's view of a resource's devices.
pub fn list_response(resource: &Resource) -> ListAndWatchResponse {
    ListAndWatchResponse {
        devices: resource
            .devices
            .iter()
            .map(|d| Device {
                id: d.id.clone(),
                health: if d.healthy { HEALTHY } else { UNHEALTHY }.to_string(),
                topology: d.numa_node.map(|n| TopologyInfo {
                    nodes: vec![NumaNode { id: i64::from(n) }],
                }),
            })
            .collect(),
    }
}

/// Serves one resource. The resource (its devices and their health) comes
/// through a watch channel: every change is sent to `ListAndWatch` streams.
#[derive(Debug, Clone)]
pub struct PluginService {
    resource: watch::Receiver<Resource>,
    inventory: Arc<Inventory>,
    settings: Arc<PluginSettings>,
    dev_root: HostRoot,
    on_list: ListHook,
}

/// Called when a `ListAndWatch` stream opens (the kubelet lists the devices).
#[derive(Clone, Default)]
struct ListHook(Option<Arc<dyn Fn() + Send + Sync>>);

impl std::fmt::Debug for ListHook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.is_some() {
            "ListHook(set)"
        } else {
            "ListHook(none)"
        })
    }
}

impl PluginService {
    pub fn new(
        resource: watch::Receiver<Resource>,
        inventory: Arc<Inventory>,
        settings: Arc<PluginSettings>,
        dev_root: HostRoot,
    ) -> Self {
        PluginService {
            resource,
            inventory,
            settings,
            dev_root,
            on_list: ListHook::default(),
        }
    }

    /// Calls `f` whenever a `ListAndWatch` stream opens.
    pub fn on_list(mut self, f: impl Fn() + Send + Sync + 'static) -> Self {
        self.on_list = ListHook(Some(Arc::new(f)));
        self
    }
}

type ListStream = Pin<Box<dyn Stream<Item = Result<ListAndWatchResponse, Status>> + Send>>;

#[tonic::async_trait]
impl DevicePlugin for PluginService {
    async fn get_device_plugin_options(
        &self,
        _: Request<Empty>,
    ) -> Result<Response<DevicePluginOptions>, Status> {
        Ok(Response::new(options()))
    }

    type ListAndWatchStream = ListStream;

    async fn list_and_watch(
        &self,
        _: Request<Empty>,
    ) -> Result<Response<Self::ListAndWatchStream>, Status> {
        let mut rx = self.resource.clone();
        if let Some(hook) = &self.on_list.0 {
            hook();
        }
        let stream = async_stream(move |tx| async move {
            loop {
                let resp = list_response(&rx.borrow_and_update());
                if tx.send(Ok(resp)).await.is_err() {
                    return;
                }
                if rx.changed().await.is_err() {
                    return;
                }
            }
        });
        Ok(Response::new(stream))
    }

    async fn get_preferred_allocation(
        &self,
        request: Request<PreferredAllocationRequest>,
    ) -> Result<Response<PreferredAllocationResponse>, Status> {
        let resource = self.resource.borrow().clone();
        let mut out = PreferredAllocationResponse::default();
        for req in request.into_inner().container_requests {
            let size = usize::try_from(req.allocation_size).map_err(|_| {
                Status::invalid_argument(format!("{}: negative allocation size", resource.name))
            })?;
            let ids = preferred::preferred(
                &resource,
                &self.inventory,
                self.settings.allocation_policy,
                &req.available_device_i_ds,
                &req.must_include_device_i_ds,
                size,
            )
            .map_err(|e| Status::invalid_argument(e.to_string()))?;
            out.container_responses
                .push(ContainerPreferredAllocationResponse { device_i_ds: ids });
        }
        Ok(Response::new(out))
    }

    async fn allocate(
        &self,
        request: Request<AllocateRequest>,
    ) -> Result<Response<AllocateResponse>, Status> {
        let resource = self.resource.borrow().clone();
        let mut out = AllocateResponse::default();
        let mut devices: Vec<String> = Vec::new();
        for req in request.into_inner().container_requests {
            devices.push(req.devices_ids.join(","));
            let resp = allocate::container_response(
                &resource,
                &self.settings,
                &self.dev_root,
                &req.devices_ids,
            )
            .map_err(|e| {
                tracing::warn!(resource = %resource.name, error = %e, "refused an allocation");
                Status::invalid_argument(e.to_string())
            })?;
            out.container_responses.push(resp);
            crate::metrics::agent::allocated(&resource.name);
        }
        tracing::info!(
            resource = %resource.name,
            containers = out.container_responses.len(),
            devices = %devices.join(" "),
            "allocated"
        );
        Ok(Response::new(out))
    }

    async fn pre_start_container(
        &self,
        _: Request<PreStartContainerRequest>,
    ) -> Result<Response<PreStartContainerResponse>, Status> {
        // pre_start_required is false: the kubelet does not call this; answer anyway.
        Ok(Response::new(PreStartContainerResponse {}))
    }
}

/// A stream fed by a task: `f` gets the sending half of a channel.
fn async_stream<F, Fut>(f: F) -> ListStream
where
    F: FnOnce(tokio::sync::mpsc::Sender<Result<ListAndWatchResponse, Status>>) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    tokio::spawn(f(tx));
    Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx))
}
