//! What a client's request is: its OpenAI-style body parsed (`openai`, its
//! prompt streamed as canonical text by `prompt_text`, a member's value found
//! for the guard by `json_span`), its prompt hashed into prefix blocks
//! (`prefix`), checked against the regions' context limits (`limits`), and
//! the router's wait for the body (`body_wait`).

pub mod body_wait;
pub mod json_span;
pub mod limits;
pub mod openai;
pub mod prefix;
pub mod prompt_text;
