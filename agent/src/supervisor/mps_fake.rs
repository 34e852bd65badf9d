//! A fake MPS control program for the supervisor's tests (the device
//! plugin's daemons and DRA claims' daemons): no daemon answers until one
//! is started on that pipe directory; `quit` ends it; the health command is
//! answered; `set_default_active_thread_percentage 13` is refused (a daemon
//! that fails at its limits); everything else is answered.

use std::sync::{Arc, Weak};

use hostlib::process::{Exit, FakeSpawner};

use crate::plugin::mps::HEALTH_COMMAND;

pub(super) fn fake_mps() -> Arc<FakeSpawner> {
    let f = Arc::new(FakeSpawner::new());
    let weak: Weak<FakeSpawner> = Arc::downgrade(&f);
    f.respond(move |launch, input| {
        let f = weak.upgrade().expect("spawner alive");
        let pipe = &launch.env["CUDA_MPS_PIPE_DIRECTORY"];
        let spawned = f.spawned();
        let live = (0..spawned.len())
            .rev()
            .find(|&n| &spawned[n].env["CUDA_MPS_PIPE_DIRECTORY"] == pipe && f.is_running(n));
        let Some(n) = live else {
            return Err("Cannot find MPS control daemon process".into());
        };
        match input.trim() {
            "quit" => {
                f.exit(
                    n,
                    Exit {
                        code: Some(0),
                        signal: None,
                    },
                );
                Ok(String::new())
            }
            HEALTH_COMMAND => Ok("25.0\n".into()),
            "set_default_active_thread_percentage 13" => Err("refused".into()),
            _ => Ok(String::new()),
        }
    });
    f
}
