//! One module per subcommand.

pub mod bench;
pub mod chat;
pub mod embed;
pub mod inspect;
pub mod models;
pub mod run;
pub mod serve;
pub mod store;
