//! The `DevicePlugin` gRPC service for one resource.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll};

use gpu_agent_proto::deviceplugin::v1beta1::device_plugin_server::{
    DevicePlugin, DevicePluginServer,
};
use gpu_agent_proto::deviceplugin::v1beta1::{
    AllocateRequest, AllocateResponse, ContainerPreferredAllocationResponse, Device,
    DevicePluginOptions, Empty, HEALTHY, ListAndWatchResponse, NumaNode, PreStartContainerRequest,
    PreStartContainerResponse, PreferredAllocationRequest, PreferredAllocationResponse,
    TopologyInfo, UNHEALTHY,
};
use hostlib::HostRoot;
use tokio::sync::watch;
use tokio_stream::Stream;
use tokio_stream::wrappers::WatchStream;
use tonic::{Request, Response, Status};

use super::allocate;
use super::preferred;
use super::resources::{PluginSettings, Resource};
use crate::inventory::Inventory;

/// `ListAndWatch` streams one plugin server (one socket) serves at once;
/// the next is refused with `ResourceExhausted`. The kubelet opens one per
/// registration, and every registration is on a new socket with a new
/// server, so a client holding streams never keeps the kubelet out.
pub const MAX_LIST_STREAMS: usize = 64;
/// The largest request message a plugin server decodes (tonic refuses a
/// larger one by its length prefix, `OutOfRange`, before buffering it).
/// Over 20,000 device IDs of our longest shape fit; the ID count is then
/// bounded by the devices advertised ([`allocate::check_size`]).
pub const MAX_REQUEST_BYTES: usize = 1 << 20;
/// HTTP/2 streams (calls) one connection may have open at once.
pub const MAX_CALLS_PER_CONNECTION: u32 = 256;

/// The tonic service for `svc`, with its message limits.
pub fn grpc_service(svc: PluginService) -> DevicePluginServer<PluginService> {
    DevicePluginServer::new(svc).max_decoding_message_size(MAX_REQUEST_BYTES)
}

/// The transport every plugin server runs on, with its HTTP/2 limits.
pub fn transport() -> tonic::transport::Server {
    tonic::transport::Server::builder().max_concurrent_streams(MAX_CALLS_PER_CONNECTION)
}

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
    /// `ListAndWatch` streams open now (shared by the clones tonic makes).
    streams: Arc<AtomicUsize>,
    /// `ListAndWatch` streams refused so far (logged at 1, 2, 4, 8...).
    refused: Arc<AtomicUsize>,
    /// True (or dropped) once this server stops: its `ListAndWatch` streams
    /// end with `Unavailable`, so a graceful shutdown does not wait on
    /// streams that would otherwise last as long as their clients.
    stopping: Option<watch::Receiver<bool>>,
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
            streams: Arc::default(),
            refused: Arc::default(),
            stopping: None,
        }
    }

    /// Ends every `ListAndWatch` stream (open or opened later) with
    /// `Unavailable` once `stopping` is true or its sender is dropped.
    pub fn with_stopping(mut self, stopping: watch::Receiver<bool>) -> Self {
        self.stopping = Some(stopping);
        self
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
        let slot = StreamSlot::take(&self.streams).ok_or_else(|| {
            let name = self.resource.borrow().name.clone();
            let refused = self.refused.fetch_add(1, Ordering::Relaxed) + 1;
            if refused.is_power_of_two() {
                tracing::warn!(resource = %name, limit = MAX_LIST_STREAMS, refused, "refused a ListAndWatch stream: too many open");
            }
            Status::resource_exhausted(format!(
                "{name}: {MAX_LIST_STREAMS} ListAndWatch streams are open on this socket, the most served at once"
            ))
        })?;
        if let Some(hook) = &self.on_list.0 {
            hook();
        }
        // No task and no queue per stream: the stream is polled when the
        // connection can send, and a client that reads slowly gets the
        // latest list, not every one in between.
        let stop: Option<StopFuture> = self.stopping.clone().map(|mut rx| {
            Box::pin(async move {
                // Err: the sender is gone, the server with it.
                let _ = rx.wait_for(|stopping| *stopping).await;
            }) as StopFuture
        });
        let stream = Counted {
            inner: WatchStream::new(self.resource.clone()),
            stop,
            name: self.resource.borrow().name.clone(),
            slot: Some(slot),
        };
        Ok(Response::new(Box::pin(stream)))
    }

    async fn get_preferred_allocation(
        &self,
        request: Request<PreferredAllocationRequest>,
    ) -> Result<Response<PreferredAllocationResponse>, Status> {
        let resource = self.resource.borrow().clone();
        let request = request.into_inner();
        let refuse = |e: allocate::AllocateError| {
            tracing::warn!(resource = %resource.name, error = %e, "refused a preferred allocation");
            Status::invalid_argument(e.to_string())
        };
        allocate::check_size(
            &resource,
            "GetPreferredAllocation",
            request.container_requests.len(),
            [],
        )
        .map_err(refuse)?;
        let mut out = PreferredAllocationResponse::default();
        for req in request.container_requests {
            for list in [&req.available_device_i_ds, &req.must_include_device_i_ds] {
                allocate::check_size(&resource, "GetPreferredAllocation", 1, [list.as_slice()])
                    .map_err(refuse)?;
            }
            let size = usize::try_from(req.allocation_size).map_err(|_| {
                Status::invalid_argument(format!("{}: negative allocation size", resource.name))
            })?;
            if size > resource.devices.len() {
                return Err(Status::invalid_argument(format!(
                    "{}: allocation size {size}; this resource advertises {}",
                    resource.name,
                    resource.devices.len()
                )));
            }
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
        let request = request.into_inner();
        allocate::check_size(
            &resource,
            "Allocate",
            request.container_requests.len(),
            request
                .container_requests
                .iter()
                .map(|c| c.devices_ids.as_slice()),
        )
        .map_err(|e| {
            tracing::warn!(resource = %resource.name, error = %e, "refused an allocation");
            Status::invalid_argument(e.to_string())
        })?;
        let mut out = AllocateResponse::default();
        let mut devices: Vec<String> = Vec::new();
        for req in request.container_requests {
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

/// One of a server's [`MAX_LIST_STREAMS`]; given back when the stream is
/// dropped (the client went away or the server stopped).
#[derive(Debug)]
struct StreamSlot(Arc<AtomicUsize>);

impl StreamSlot {
    fn take(count: &Arc<AtomicUsize>) -> Option<Self> {
        count
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < MAX_LIST_STREAMS).then_some(n + 1)
            })
            .ok()
            .map(|_| StreamSlot(count.clone()))
    }
}

impl Drop for StreamSlot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

type StopFuture = Pin<Box<dyn Future<Output = ()> + Send>>;

/// A resource's lists, holding a stream slot while it lives; ends with
/// `Unavailable` when its server stops.
struct Counted {
    inner: WatchStream<Resource>,
    /// Resolves when the server stops (None: never).
    stop: Option<StopFuture>,
    name: String,
    /// None once the stream has ended (the slot is given back at once).
    slot: Option<StreamSlot>,
}

impl Stream for Counted {
    type Item = Result<ListAndWatchResponse, Status>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        if self.slot.is_none() {
            return Poll::Ready(None);
        }
        if let Some(stop) = self.stop.as_mut()
            && stop.as_mut().poll(cx).is_ready()
        {
            self.slot = None;
            self.stop = None;
            tracing::debug!(resource = %self.name, "ended a ListAndWatch stream: the server stops");
            return Poll::Ready(Some(Err(Status::unavailable(format!(
                "{}: this device-plugin server is stopping (the kubelet restarted, the resource \
                 is gone, or the agent stops); the agent registers again on a new socket \
                 unless it is stopping",
                self.name
            )))));
        }
        Pin::new(&mut self.inner)
            .poll_next(cx)
            .map(|r| r.map(|r| Ok(list_response(&r))))
    }
}
