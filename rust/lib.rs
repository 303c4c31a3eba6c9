//! mlxgate stream core: token ids to text, markup and stop matching, protocol events, SSE frames, bounded channels.

pub mod channel;
pub mod detok;
pub mod error;
pub mod events;
pub mod jsonscan;
pub mod loop_guard;
pub mod markup;
pub mod router;
pub mod sse;
pub mod stop;
pub mod vocab;

#[cfg(feature = "python")]
mod py;

pub use error::CoreError;
