//! `pluginregistration.Registration`, served on the registration socket: the
//! kubelet reads [`GetInfo`](RegistrationService) and tells the plugin its
//! verdict, kept on a watch channel as a [`Registration`].

use std::path::PathBuf;

use gpu_agent_proto::pluginregistration::registration_server::Registration as RegistrationApi;
use gpu_agent_proto::pluginregistration::{
    DRA_PLUGIN, InfoRequest, PluginInfo, RegistrationStatus, RegistrationStatusResponse,
};
use gpu_agent_proto::{dra, dra_health};
use tokio::sync::watch;
use tonic::{Request, Response, Status};

use crate::claim::DRIVER_NAME;

/// What the kubelet last said about this plugin (`NotifyRegistrationStatus`,
/// the only signal that it accepted the plugin).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum Registration {
    /// Nothing yet (or the plugin is not serving).
    #[default]
    Unknown,
    /// The kubelet registered the plugin.
    Registered,
    /// The kubelet refused the plugin, with its reason.
    Refused { error: String },
}

impl Registration {
    pub fn is_registered(&self) -> bool {
        matches!(self, Registration::Registered)
    }
}

/// The API versions the plugin serves, in the order the kubelet walks them
/// (it takes the first it knows): registration strings, not service names;
/// then the health service, as the upstream helper lists it (kubelets pick
/// the DRA version among the first two and ignore it for that choice).
pub fn supported_versions() -> Vec<String> {
    vec![
        dra::v1::SERVICE.to_string(),
        dra::v1beta1::SERVICE.to_string(),
        dra_health::v1alpha1::SERVICE.to_string(),
    ]
}

/// The registration service: what `GetInfo` answers and where the kubelet's
/// verdict goes.
#[derive(Debug)]
pub struct RegistrationService {
    /// The DRA socket's absolute path as the kubelet sees it.
    endpoint: PathBuf,
    status: watch::Sender<Registration>,
}

impl RegistrationService {
    /// `endpoint`: the DRA socket as the kubelet sees it (absolute).
    pub fn new(endpoint: PathBuf, status: watch::Sender<Registration>) -> Self {
        RegistrationService { endpoint, status }
    }

    /// What `GetInfo` answers.
    pub fn info(&self) -> PluginInfo {
        PluginInfo {
            r#type: DRA_PLUGIN.to_string(),
            name: DRIVER_NAME.to_string(),
            endpoint: self.endpoint.display().to_string(),
            supported_versions: supported_versions(),
        }
    }

    /// Keeps the kubelet's verdict; a refusal comes back as an error carrying
    /// the kubelet's text (as the upstream helper answers).
    pub fn notify(&self, status: &RegistrationStatus) -> Result<(), String> {
        if status.plugin_registered {
            tracing::info!(
                driver = DRIVER_NAME,
                endpoint = %self.endpoint.display(),
                "the kubelet registered the DRA plugin"
            );
            self.status.send_replace(Registration::Registered);
            Ok(())
        } else {
            tracing::warn!(
                driver = DRIVER_NAME,
                endpoint = %self.endpoint.display(),
                error = %status.error,
                "the kubelet refused the DRA plugin"
            );
            self.status.send_replace(Registration::Refused {
                error: status.error.clone(),
            });
            Err(format!(
                "the kubelet refused DRA plugin {DRIVER_NAME}: {}",
                status.error
            ))
        }
    }
}

#[tonic::async_trait]
impl RegistrationApi for RegistrationService {
    async fn get_info(&self, _: Request<InfoRequest>) -> Result<Response<PluginInfo>, Status> {
        tracing::debug!(
            driver = DRIVER_NAME,
            "the kubelet asked for the plugin's info"
        );
        Ok(Response::new(self.info()))
    }

    async fn notify_registration_status(
        &self,
        request: Request<RegistrationStatus>,
    ) -> Result<Response<RegistrationStatusResponse>, Status> {
        self.notify(request.get_ref())
            .map(|()| Response::new(RegistrationStatusResponse {}))
            .map_err(Status::unknown)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn service() -> (RegistrationService, watch::Receiver<Registration>) {
        let (tx, rx) = watch::channel(Registration::default());
        (
            RegistrationService::new(
                PathBuf::from("/var/lib/kubelet/plugins/gpu.nvidia.com/dra.sock"),
                tx,
            ),
            rx,
        )
    }

    #[test]
    fn info_names_the_driver_endpoint_and_versions_in_order() {
        let (svc, _) = service();
        let info = svc.info();
        assert_eq!(info.r#type, "DRAPlugin");
        assert_eq!(info.name, "gpu.nvidia.com");
        assert_eq!(
            info.endpoint,
            "/var/lib/kubelet/plugins/gpu.nvidia.com/dra.sock"
        );
        assert_eq!(
            info.supported_versions,
            [
                "v1.DRAPlugin",
                "v1beta1.DRAPlugin",
                "v1alpha1.DRAResourceHealth"
            ]
        );
    }

    #[tokio::test]
    async fn a_registration_reaches_the_watch_channel() {
        let (svc, rx) = service();
        assert_eq!(*rx.borrow(), Registration::Unknown);
        svc.notify_registration_status(Request::new(RegistrationStatus {
            plugin_registered: true,
            error: String::new(),
        }))
        .await
        .unwrap();
        assert!(rx.borrow().is_registered());
    }

    #[tokio::test]
    async fn a_refusal_is_kept_and_answered_with_the_kubelets_text() {
        let (svc, rx) = service();
        let err = svc
            .notify_registration_status(Request::new(RegistrationStatus {
                plugin_registered: false,
                error: "endpoint already registered".to_string(),
            }))
            .await
            .unwrap_err();
        assert_eq!(err.code(), tonic::Code::Unknown);
        assert!(
            err.message().contains("endpoint already registered"),
            "{err:?}"
        );
        assert_eq!(
            *rx.borrow(),
            Registration::Refused {
                error: "endpoint already registered".to_string()
            }
        );
        // A later acceptance replaces it.
        svc.notify(&RegistrationStatus {
            plugin_registered: true,
            error: String::new(),
        })
        .unwrap();
        assert_eq!(*rx.borrow(), Registration::Registered);
    }
}
