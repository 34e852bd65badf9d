//! The ClusterPolicy CRD we ship, checked against the real 1.36
//! apiextensions schema (unknown fields are errors), and read back by the
//! controller's own idea of the resource.

mod common;

use common::{repo, schema};

#[test]
fn the_cluster_policy_crd_is_what_an_api_server_takes() {
    let path = repo().join("packaging/crds/nvidia.com_clusterpolicies.yaml");
    let text = std::fs::read_to_string(&path).unwrap();
    let crd: serde_json::Value = serde_yaml_ng::from_str(&text).unwrap();
    let schemas = schema::load();
    let errs = schema::check(
        &schemas,
        "io.k8s.apiextensions-apiserver.pkg.apis.apiextensions.v1.CustomResourceDefinition",
        &crd,
        false,
    );
    assert!(errs.is_empty(), "{}: {errs:?}", path.display());
    // The name is <plural>.<group>, and it is the resource the controller watches.
    let ar = gpu_controller::cluster_policy::resource();
    assert_eq!(
        crd["metadata"]["name"],
        format!("{}.{}", ar.plural, ar.group)
    );
    assert_eq!(crd["spec"]["names"]["kind"], ar.kind);
    assert_eq!(crd["spec"]["versions"][0]["name"], ar.version);
    assert_eq!(crd["spec"]["scope"], "Cluster");
}
